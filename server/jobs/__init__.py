"""Fine-tuning jobs off the request path: the worker that claims them (`worker`) and the process each attempt trains
in (`attempt`)."""
