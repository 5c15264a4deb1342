"""The core a learner reads: config, attention, kv_cache, gpt, generate, in that order. It imports
only torch and itself; every other file of model/ builds on it."""
