"""The agreement between ranks: the wire format, the transport, and the roll call on failure."""
