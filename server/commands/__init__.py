"""The server's `zaya` commands: database, keys, API server, worker and registry (`manage`), and `zaya run`, the whole
stack on one machine (`run`)."""
