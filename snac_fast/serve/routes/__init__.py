"""The HTTP and WebSocket routes, one module per route family, with their request shapes
(``protocol``: OpenAI's; ``elevenlabs_protocol``; ``schema``: the pydantic types and
``/openapi.json``) and ``responses`` (a spoken request's response, shared by OpenAI's and
ElevenLabs' speech routes). A route reads its request and calls a service; no route imports another."""
