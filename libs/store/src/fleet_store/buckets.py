"""The buckets Fleet uses, and their creation."""

from __future__ import annotations

from fleet_store.client import ObjectStore

MODELS_BUCKET = "fleet-models"
"""<model_id>/<revision>/<files> and manifest.json."""
KV_BUCKET = "fleet-kv"
"""<model_fingerprint>/<block_hash> (shared prefix tier) and handoff/<request_id>/... (prefill -> decode)."""

ALL_BUCKETS = (MODELS_BUCKET, KV_BUCKET)


def ensure_buckets(store: ObjectStore) -> None:
    for bucket in ALL_BUCKETS:
        store.ensure_bucket(bucket)
