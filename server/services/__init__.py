"""Business logic shared by the HTTP routes, the CLI and the worker. Services take a Session and plain values."""
