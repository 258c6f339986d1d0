"""What crosses process boundaries: the typed request / output messages with their encode and decode."""
