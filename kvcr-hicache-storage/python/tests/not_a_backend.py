"""A class with every method of a storage backend that does not subclass
SGLang's HiCacheStorage; SGLang's loader must refuse it."""


class LooksLikeStorage:
    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config

    def get(self, key, target_location=None, target_sizes=None):
        return None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [None] * len(keys)

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return False

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return False

    def exists(self, key):
        return False
