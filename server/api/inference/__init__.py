"""OpenAI's `/v1/chat/completions` and `/v1/completions`: the request models and their conversion to sampling
parameters (`protocol`), the response bodies and streamed chunks (`responses`), the routes (`routes`) and how a
generation becomes a whole answer or a stream (`serving`). The work itself is `server.services.inference`."""
