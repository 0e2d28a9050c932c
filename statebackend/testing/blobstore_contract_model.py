"""The dict model of the blob store contract suite: a Hypothesis state machine that runs random operations on the
store under test and on a dict, which must agree (:meth:`BlobStoreContract.run_state_machine
<statebackend.testing.blobstore_contract.BlobStoreContract.run_state_machine>` runs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from statebackend.blobstores.base import BlobStore
from statebackend.errors import AlreadyExistsError, NotFoundError

if TYPE_CHECKING:
    from statebackend.testing.blobstore_contract import BlobStoreContract

# no name is a directory of another ("a" and "a/b"), which a file:// store cannot hold at once
_NAMES = st.sampled_from(["a", "b", "ab", "c/x", "c/y", "c/xy", "d/e/f", "d/e/g", "d/h"])
_PREFIXES = st.sampled_from(["", "a", "c", "c/", "c/x", "d/e", "d/e/", "z"])
_DATA = st.binary(max_size=64)
_METADATA = st.dictionaries(st.sampled_from(["kind", "expiry"]), st.sampled_from(["1", "delta", "17000"]), max_size=2)


class _BlobStoreMachine(RuleBasedStateMachine):
    """Runs random operations on the store and on a dict; they must agree. ``store`` and ``contract`` are set by the
    test; each example starts by emptying the store through its own API."""

    store: BlobStore
    contract: BlobStoreContract

    def __init__(self) -> None:
        super().__init__()
        for name in list(self.store.list()):
            self.store.delete(name)
        self.model: dict[str, tuple[bytes, dict[str, str]]] = {}

    @rule(name=_NAMES, data=_DATA, metadata=_METADATA)
    def put(self, name: str, data: bytes, metadata: dict[str, str]) -> None:
        self.store.put(name, data, metadata=metadata)
        self.model[name] = (data, metadata)

    @rule(name=_NAMES, data=_DATA)
    def put_create_only(self, name: str, data: bytes) -> None:
        try:
            self.store.put(name, data, create_only=True)
        except AlreadyExistsError:
            assert name in self.model
        else:
            assert name not in self.model
            self.model[name] = (data, {})

    @rule(name=_NAMES)
    def delete(self, name: str) -> None:
        self.store.delete(name)
        self.model.pop(name, None)

    @rule(name=_NAMES, metadata=_METADATA)
    def set_metadata(self, name: str, metadata: dict[str, str]) -> None:
        try:
            self.store.set_metadata(name, metadata)
        except NotFoundError:
            assert name not in self.model
        else:
            self.model[name] = (self.model[name][0], metadata)

    @rule(name=_NAMES)
    def get(self, name: str) -> None:
        try:
            data = self.store.get(name)
        except NotFoundError:
            assert name not in self.model
        else:
            assert data == self.model[name][0]
            assert self.contract.raw_get(self.store, name) == data

    @rule(name=_NAMES)
    def head(self, name: str) -> None:
        try:
            info = self.store.head(name)
        except NotFoundError:
            assert name not in self.model
        else:
            data, metadata = self.model[name]
            assert (info.size, dict(info.metadata)) == (len(data), metadata)

    @rule(prefix=_PREFIXES)
    def list_prefix(self, prefix: str) -> None:
        assert list(self.store.list(prefix)) == sorted(n for n in self.model if n.startswith(prefix))

    @invariant()
    def names_agree(self) -> None:
        assert list(self.store.list()) == sorted(self.model)
