"""Integrity: what makes a checkpoint's bytes trustworthy.

* :mod:`.digest`: the checksum algorithms a manifest's digests are made with;
* :mod:`.crypto`: encryption at rest (AES-256-GCM per file, chunked);
* :mod:`.verify`: the one path by which stored bytes are checked against a manifest.

``digest`` and ``crypto`` depend on nothing else of the project (the storage layer's
hashing writer uses them); ``verify`` reads through :mod:`raycheckpoint.storage`.  This
package imports none of its modules, so importing one of them costs only that one.
"""
