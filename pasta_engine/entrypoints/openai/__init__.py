"""The OpenAI-compatible server (``pasta-engine serve``): :mod:`.api_server` builds the app and
runs it; its concerns, one a module, are listed there."""
