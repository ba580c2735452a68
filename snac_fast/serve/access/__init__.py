"""Who may use the server and how much: ``auth`` (API keys, origins), ``limits`` (body, header and
message limits, streams per client, uvicorn's options)."""
