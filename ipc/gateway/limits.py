"""What one HTTP request may cost a gateway worker (docs/reliability.md, "Hostile clients").

Shared by the app, the worker processes and the ``forerun serve`` flags that set them.
"""

# --max-request-bytes: a full 8k-token context of text is about 40 KB, so 4 MiB leaves room for
# token-id lists and many prompts; a larger body is a 413 before it is read in full.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# A request body of which no byte came for this many seconds is a 408, its bytes dropped and its connection
# closed: clients that stall mid-upload cannot pile up memory in a worker.  (uvicorn's own timer covers only
# the idle time between requests of a kept-alive connection, and none covers a stall inside the headers.)
DEFAULT_BODY_TIMEOUT_S = 30.0
# --api-tokenizer-threads: the pool that templates and tokenizes long prompts off the event loop.
DEFAULT_TOKENIZER_THREADS = 2
# Prompts up to this many characters are templated and tokenized on the event loop (tens of
# microseconds: a thread hop would cost more); longer ones in the pool.
INLINE_CHARS = 4096
# A refused body up to this size is read and dropped before the 413, so that a client still sending
# it reads the answer instead of a broken pipe; beyond it the connection is left to close.
DISCARD_MAX_BYTES = 64 * 2**20
# One /v1/completions request's prompts times n (each a request to the scheduler): within the scheduler's
# default --max-waiting (4096), so one request never meets the "overloaded" answer it could only retry in vain.
MAX_PROMPTS = 1024
# An error message never echoes more of the input than this.
MAX_ERROR_MESSAGE_CHARS = 1024
