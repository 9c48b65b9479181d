"""Typed messages of llamactor: what actors say to each other and what goes over HTTP.

- ``protocol.messages``: one frozen, tagged Struct union per actor mailbox.
- ``protocol.events``: what a group sends down a request's result stream.
- ``protocol.sampling``: the sampling parameters of one request (no I/O, no ctypes).
- ``protocol.wire``: HTTP request/response bodies (llama-server native and OpenAI).
- ``protocol.chat``: a chat's messages, tools and tool choice (OpenAI's shapes), typed.
- ``protocol.sse``: Server-Sent Events framing.

Nothing here does I/O; everything is a msgspec Struct so it validates and encodes fast.
"""
