"""The errors the collective guard raises on every rank."""


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (or different numbers of them)."""


class StoreMessageError(CollectiveMismatchError):
    """A value the guard read from the rendezvous store is not what a rank of this job writes there (too long,
    not JSON, or not of the expected shape): the ranks cannot be compared, so the job stops. The message names the
    key and the rank it belongs to. The store has no authentication: something else may have written the key."""
