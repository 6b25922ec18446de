"""Offline preparation: data sources read and checked, examples tokenised into windows, the feature cache
built in parallel and published once (see cache.py); training then reads it through elastic_qa.data.

The entry point is `prepare` (the cache for a config, built first if no process has yet), with the
`Featurizer` protocol a model family meets and `cache_key`.
"""

from elastic_qa.prep.cache import Featurizer, cache_key, prepare

__all__ = ["Featurizer", "cache_key", "prepare"]
