"""Models that ship with paramshard: ``gpt``, the small GPT that README, the tests, the
benchmarks and the demo train (it carries its own tensor-parallel plan, ``GPT._tp_plan``)."""
