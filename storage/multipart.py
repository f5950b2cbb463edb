"""S3 multipart upload: how a large blob reaches S3 so that its object appears only once complete."""

from __future__ import annotations

from typing import Any

from pt2flow.storage.faults import crash_point

# Blobs of this size or more go to S3 as a multipart upload of MULTIPART_PART_SIZE parts (S3's
# minimum part size is 5 MiB). The object appears only when the upload is completed; a writer
# killed before that leaves no object (the parts are invisible and an S3 lifecycle rule for
# incomplete uploads reclaims them); a writer that fails aborts the upload.
MULTIPART_THRESHOLD = 64 * 2**20
MULTIPART_PART_SIZE = 16 * 2**20


def wants_multipart(fs: Any, size: int) -> bool:
    """Whether `size` bytes go to `fs` as a multipart upload: an S3 filesystem and at least
    MULTIPART_THRESHOLD bytes (read here, at call time: tests lower it)."""
    return hasattr(fs, "call_s3") and size >= MULTIPART_THRESHOLD


def is_precondition_failed(exc: BaseException) -> bool:
    """A conditional S3 write (If-None-Match: *) that found an object already there."""
    return isinstance(exc, FileExistsError) or "PreconditionFailed" in str(exc) or "412" in str(exc)


def s3_multipart_upload(fs: Any, path: str, data: bytes, exclusive: bool) -> bool:
    """Upload `data` to `path` in MULTIPART_PART_SIZE parts and complete the upload (If-None-Match: *
    when exclusive: returns False when an object is already there); any failure aborts it."""
    bucket, key, _ = fs.split_path(path)
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    parts = []
    try:
        for number, start in enumerate(range(0, len(data), MULTIPART_PART_SIZE), 1):
            if number > 1:
                crash_point("mid_multipart_upload")
            out = fs.call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data[start : start + MULTIPART_PART_SIZE],
            )
            parts.append({"PartNumber": number, "ETag": out["ETag"]})
        match = {"IfNoneMatch": "*"} if exclusive else {}
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            **match,
        )
    except BaseException as exc:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception:
            pass  # the parts stay invisible; a lifecycle rule reclaims them
        if exclusive and isinstance(exc, Exception) and is_precondition_failed(exc):
            return False
        raise
    finally:
        fs.invalidate_cache(path)
    return True
