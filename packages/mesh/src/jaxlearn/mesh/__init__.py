"""jaxlearn.mesh: Meshes, logical-to-physical axis rules, mesh rules (regex -> modifiers), hardware catalogue."""
