"""`elastic-qa serve`: extractive QA over HTTP (docs/serve.md).

cli.py (the command), http.py (the server: routes, limits, graceful stop), schema.py (the request body),
batcher.py (one model thread answering many requests' questions per call), page.py (the page at /).
"""
