"""Concrete state backends, one folder each, mirroring the contracts in statebackend.contracts:
changelog/ (changelog-delta) and blobsnapshot/ (blob-snapshot). A third-party backend needs no edit here: register
its factory under the ``statebackend.backends`` entry-point group, or name it by dotted path."""
