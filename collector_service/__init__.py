"""Collector service: a FastAPI app that writes capture frames to durable, indexed shards.

    eagle-tap collect --shards D [--host 127.0.0.1 --port 8470 --token-file F --durability fsync]
    eagle-tap shards verify|stats|repair --shards D

HTTP API (`Authorization: Bearer <token>` on /v1/* when a token is set):
    POST /v1/records       body: one frame, application/octet-stream. 201 {"status": "stored", ...} once
                           durable; 200 {"status": "duplicate", ...} if the id is already stored (nothing
                           written); errors {"error": <reason>, "detail": ...}, listed in errors.py
    GET  /v1/records/{id}  where a stored record lies (shard, offset, sealed); 404 if not stored
    GET  /v1/stats         records, tokens, bytes raw/stored, shards, duplicates, rejects by reason
    GET  /healthz          200 while records can be stored, 503 after a storage failure
    GET  /metrics          Prometheus

Modules: settings (CollectorSettings, EAGLE_TAP_COLLECTOR_*), app (create_app, lifespan), receive
(stream a body into one pooled buffer, inspect_frame), store (dedupe, submission, stats), writer
(the one thread that appends, group-commits and seals), catalog (start-up recovery and the id
index), routes_records / routes_health / metrics (one router each), dependencies (store, token),
errors (reason codes), buffers (receive buffers), malloc_tuning, shard_tools and cli (commands).
"""
