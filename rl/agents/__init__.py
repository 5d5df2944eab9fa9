"""Training agents someone else wrote: an OpenAI-compatible endpoint in front of the rollout
engine (endpoint.py), sessions that record every call's exact tokens and link them into the
sequences a trainer trains on (sessions.py), and the chat rendering between OpenAI's messages
and the checkpoint's tokens (chat.py)."""
