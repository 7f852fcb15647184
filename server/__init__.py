"""The ZAYA platform service: OpenAI-compatible API, job worker and model registry."""
