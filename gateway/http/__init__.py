"""HTTP/1.1 pieces both the data plane and the admin listener use: the codec seam (the only user of
the wire parser), the strict-intermediary checks, the one error builder, media-type rules."""
