"""Reusable pieces codecs are built from: bit packing, quantizers, (later) transforms and entropy coders."""
