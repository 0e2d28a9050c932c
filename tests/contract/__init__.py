"""Contract test suites that every implementation of a contract subclasses (see blobstore_contract.py)."""
