"""What the routes call: ``speech`` (text spoken into one engine stream), ``spoken_text`` (text
that arrives in pieces, spoken into one stream), ``formats`` (audio encoded as it is made)."""
