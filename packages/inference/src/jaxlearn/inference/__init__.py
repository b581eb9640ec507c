"""jaxlearn.inference: Inference engine (prefill/extend), sampling, batching scheduler, server."""
