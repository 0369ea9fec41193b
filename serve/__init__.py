"""jaxcb's gRPC front end: the server, its metrics, and Python clients."""
