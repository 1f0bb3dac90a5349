"""Fleet object storage: buckets, verified put/get (sha256 in object metadata), model manifests."""

from fleet_store.buckets import ALL_BUCKETS, KV_BUCKET, MODELS_BUCKET, ensure_buckets
from fleet_store.cards import (
    CARD_TEXT_FILES,
    ST_MODULES,
    CardError,
    base_model_name,
    embedding_facts,
    model_card,
    pooling_config_path,
    publisher_of,
)
from fleet_store.client import SHA256_METADATA, ObjectInfo, ObjectStore, S3Settings
from fleet_store.errors import (
    IntegrityError,
    ObjectNotFound,
    StoreAuthError,
    StoreError,
    StoreUnavailable,
)
from fleet_store.hashing import Progress, sha256_file
from fleet_store.manifest import (
    DEFAULT_REVISION,
    FetchResult,
    ManifestFile,
    ModelManifest,
    build_manifest,
    fetch_model,
    file_key,
    load_manifest,
    manifest_key,
    model_prefix,
    stage_folder,
)
from fleet_store.resumable import UploadResult, abandon_stale_uploads, put_file_resumable

__all__ = [
    "ALL_BUCKETS",
    "CARD_TEXT_FILES",
    "DEFAULT_REVISION",
    "KV_BUCKET",
    "MODELS_BUCKET",
    "SHA256_METADATA",
    "ST_MODULES",
    "CardError",
    "FetchResult",
    "IntegrityError",
    "ManifestFile",
    "ModelManifest",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "Progress",
    "S3Settings",
    "StoreAuthError",
    "StoreError",
    "StoreUnavailable",
    "UploadResult",
    "abandon_stale_uploads",
    "base_model_name",
    "build_manifest",
    "embedding_facts",
    "ensure_buckets",
    "fetch_model",
    "file_key",
    "load_manifest",
    "manifest_key",
    "model_card",
    "model_prefix",
    "pooling_config_path",
    "publisher_of",
    "put_file_resumable",
    "sha256_file",
    "stage_folder",
]
