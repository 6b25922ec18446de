"""Training-time input: the published feature cache opened (cache.py), the QA examples it holds
(examples.py) and its windows' columns (features.py), one global order with a world-size-free cursor
(cursor.py), and this rank's batches (loader.py). Nothing here builds a cache: elastic_qa.prep does."""
