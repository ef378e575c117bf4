"""How bytes move: NATS connections, streams, events, experiences, and weight transports."""
