"""Blob store implementations, one module each: file, memory, azure, s3. Open one with
:func:`statebackend.blobstores.base.open_blob_store`."""
