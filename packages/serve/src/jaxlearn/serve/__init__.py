"""jaxlearn.serve: the OpenAI-compatible HTTP server on `jaxlearn.inference.Engine`.

    from jaxlearn.serve import InferenceServer
    server = InferenceServer(engine, "127.0.0.1", 8000).start()
"""

from jaxlearn.serve.server import InferenceServer

__all__ = ["InferenceServer"]
