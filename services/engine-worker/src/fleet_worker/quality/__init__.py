"""How close an engine and weight format come to a float32 reference of the same weights.

The reference (reference.py, torch in float32) is computed once per model on a node and kept in its
state dir. An engine is then measured through its public contract, as it serves: teacher-forced
next-token distributions (one request per position of a fixed evaluation text, one output token with
its top-20 log-probabilities; each request extends the last, so engines with prefix reuse feed the
new token the way they decode) and greedy answers to fixed chat prompts. score() compares them.
"""
