"""The language model's side: ``client`` (an OpenAI-compatible completions stream read as audio
ids), ``segments`` (long text a sentence or two at a time), ``fake`` (a stand-in LM for tests and
benchmarks: ``python -m snac_fast.serve.lm.fake``)."""
