"""jaxlearn.module: Module system: Module, InvocationContext, functional, ParameterSpec, parameter init, output collections, remat, scan over layers, Flax adapters."""
