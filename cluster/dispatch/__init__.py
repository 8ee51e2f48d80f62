"""One request's way through the workers: the `Dispatcher` (dispatch.py) and one attempt
(attempt.py)."""
