"""What a storage client's error says: whether the storage answered.

Read by the path layer (a bucket that does not answer a listing or a
write is said as such, not as a refusal) and by the rule that tells a
damaged checkpoint from an outage (runtime/storage_faults.py).
"""

import re

# Words of a message that say the connection failed or timed out.
_UNANSWERED_WORDS = ('timed out', 'Connection reset', 'Connection refused',
                     'Server disconnected', 'Failed to connect')
# The HTTP status behind a TensorStore error, in its message.
_TENSORSTORE_HTTP_STATUS = re.compile(r"http_response_code='(\d+)'")
# Exception classes of the storage clients (matched by name, so that none
# of them is imported here) that mean the service did not answer.
_UNANSWERED_CLASSES = ('ClientConnectionError', 'ClientOSError',
                       'ServerDisconnectedError', 'ServerTimeoutError',
                       'ConnectionError', 'Timeout', 'TransportError',
                       'ServiceUnavailable', 'TooManyRequests',
                       'GatewayTimeout', 'InternalServerError', 'BadGateway',
                       'RetryError')


def chain(error: BaseException):
  """`error` and the errors it was raised from or while handling."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def http_status(error: BaseException) -> int | None:
  """The HTTP status `error` carries or names in its message, if any."""
  status = getattr(error, 'code', None)
  if status is None:
    status = getattr(error, 'status', None)
  if isinstance(status, int):
    return status
  match = _TENSORSTORE_HTTP_STATUS.search(str(error))
  return int(match[1]) if match else None


def unanswered(error: BaseException) -> bool:
  """Whether `error` itself says the storage did not answer, or answered
  that it may later (HTTP 408, 429, 5xx; a refused or dropped connection,
  a timeout)."""
  status = http_status(error)
  if status is not None:
    return status in (408, 429) or status >= 500
  return (isinstance(error, (TimeoutError, ConnectionError)) or
          any(cls.__name__ in _UNANSWERED_CLASSES
              for cls in type(error).__mro__) or
          any(word in str(error) for word in _UNANSWERED_WORDS))


def unavailable(error: BaseException) -> bool:
  """Whether `error` or one it was raised from says the storage did not
  answer, or answered that it may later (`unanswered`), rather than
  refused the request (credentials, permissions, a missing bucket): what
  to tell a user who asked for a write or a listing."""
  return any(unanswered(e) for e in chain(error))


def first_line(error: BaseException) -> str:
  """The error's type and the first line of its message, shortened."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0][:300] if lines else ""}'
