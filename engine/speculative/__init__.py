"""Speculative decoding: drafters, verification and the adaptive draft-length policy."""
