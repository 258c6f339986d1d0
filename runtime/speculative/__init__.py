"""Speculative decoding: proposers (n-gram prompt lookup; EAGLE / EAGLE-3 draft heads, chains or trees), one target
pass that verifies each request's draft, and the acceptance rule that keeps the output distributed as the target's."""
