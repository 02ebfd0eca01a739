"""How the rest talks to the engine service: its HTTP API (wire models and client), the state
and token files that say where it listens, and the record of each step it trained. Light:
no torch, no megatron."""
