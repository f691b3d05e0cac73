"""Engine: prefill, compression, the decoding pool and teacher forcing; it returns what it finished, with its cost,
and writes nothing."""
