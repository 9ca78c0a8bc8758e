"""A local HTTP server that replays the documented vLLM 0.33.0 / SGLang 0.5.23 protocol. No GPU engine runs.

It implements the routes our adapters and ``weightsync/engine_push.py`` use, with the engines' rules (from
``docs/engines.md §5`` and the wheels' source): vLLM rejects ``/update_weights`` outside
``start``→``finish`` and generation while paused in ``abort``/``wait`` mode (503); SGLang refuses
``/update_weights_from_distributed`` outside ``begin``→``end`` (``success: false``), refuses ``/flush_cache``
after an ``in_place`` pause, and labels outputs with ``weight_versions`` spans. Generation is a
deterministic function of the prompt; logprobs are fixed numbers.

The weight data plane is real: on ``/init_weight_transfer_engine`` / ``/init_weights_update_group`` the
server joins a **gloo** group at the given address, rank offset and world size, and each update route
receives the announced tensors by broadcast from rank 0. For SGLang that is SGLang's own protocol with
``backend: gloo``; for vLLM it stands in for PyNccl, which needs a GPU (group name ``vllm-replay``).

Test hooks: ``GET /_log`` (every request in order), ``GET /_weights`` (received tensors as lists),
``POST /_fault {route, status, delay}`` (one-shot), ``POST /_reset``.
Run: ``python tests/engine_replay_server.py --kind vllm|sglang --port-file PATH``.
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tandem.net import free_port
from weightsync.engine_push import init_custom_process_group

VLLM_GROUP = "vllm-replay"


class State:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.faults: dict[str, dict[str, Any]] = {}
        self.version = "default" if self.kind == "vllm" else "0"
        self.paused: str | None = None
        self.in_update = False
        self.group: Any = None
        self.weights: dict[str, torch.Tensor] = {}
        self.last_meta: tuple[list[str], list[str], list[list[int]]] | None = None
        self.released: set[str] = set()  # sleep mode: what is freed (weights, kv_cache)


def make_app(kind: str) -> FastAPI:
    app = FastAPI()
    st = State(kind)

    def record(route: str, request: Request, body: Any) -> JSONResponse | None:
        with st.lock:
            st.log.append({"route": route, "query": dict(request.query_params), "body": body})
            fault = st.faults.pop(route, None)
        if fault is not None:
            time.sleep(fault.get("delay", 0.0))
            if fault.get("status"):
                return JSONResponse({"error": f"injected fault on {route}"}, status_code=fault["status"])
        return None

    def tokens_for(prompt: list[int], j: int, max_tokens: int) -> list[int]:
        return [(prompt[-1] + 7 * j + k + 1) % 97 for k in range(max_tokens)]

    def join_group(addr: str, port: int, rank: int, world: int, name: str) -> None:
        st.group = init_custom_process_group(
            "gloo", f"tcp://{addr}:{port}", timedelta(seconds=30), world, rank, name
        )

    def receive(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(t, src=0, group=st.group)
            st.weights[name] = t

    # ------------------------------------------------------------------ hooks
    @app.get("/_log")
    def get_log() -> Any:
        return st.log

    @app.get("/_weights")
    def get_weights() -> Any:
        return {k: v.float().flatten().tolist() for k, v in st.weights.items()}

    @app.post("/_fault")
    async def set_fault(request: Request) -> Any:
        body = await request.json()
        st.faults[body["route"]] = body
        return {"ok": True}

    @app.post("/_reset")
    def reset() -> Any:
        st.reset()
        return {"ok": True}

    @app.get("/health")
    def health() -> Any:
        return PlainTextResponse("")

    if kind == "vllm":
        _vllm_routes(app, st, record, tokens_for, join_group, receive)
    else:
        _sglang_routes(app, st, record, tokens_for, join_group, receive)
    return app


def _vllm_routes(
    app: FastAPI, st: State, record: Any, tokens_for: Any, join_group: Any, receive: Any
) -> None:
    @app.get("/version")
    def version(request: Request) -> Any:
        return record("/version", request, None) or {"version": "0.33.0"}

    @app.post("/inference/v1/generate")
    def generate(request: Request, body: dict[str, Any] = Body()) -> Any:
        # A plain def runs in the server's thread pool: a delay injected here holds this request only.
        if (r := record("/inference/v1/generate", request, body)) is not None:
            return r
        if st.paused in ("abort", "wait") or st.released:
            return JSONResponse(
                {"error": f"engine paused or asleep ({sorted(st.released)})"}, status_code=503
            )
        sp = body["sampling_params"]
        choices = []
        for j in range(sp["n"]):
            ids = tokens_for(body["token_ids"], j, sp["max_tokens"])
            content = [{"token_id": t, "logprob": -0.25, "rank": 1, "top_logprobs": []} for t in ids]
            choices.append(
                {
                    "index": j,
                    "token_ids": ids,
                    "logprobs": {"content": content},
                    "finish_reason": "length",
                    "stop_reason": None,
                    "weight_versions": [{"version": st.version, "start": 0, "end": len(ids)}],
                }
            )
        return {
            "request_id": "generate-tokens-replay",
            "output_mode": body["output_mode"],
            "choices": choices,
        }

    @app.post("/pause")
    def pause(request: Request, mode: str = "abort") -> Any:
        if (r := record("/pause", request, None)) is not None:
            return r
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"bad mode {mode}"}, status_code=400)
        st.paused = mode
        return {"status": "paused"}

    @app.post("/resume")
    def resume(request: Request) -> Any:
        if (r := record("/resume", request, None)) is not None:
            return r
        st.paused = None
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Any:
        body = await request.json()
        if (r := record("/collective_rpc", request, body)) is not None:
            return r
        if not all(isinstance(v, str) for v in body.get("kwargs", {}).values()):
            return JSONResponse({"detail": "kwargs must be strings"}, status_code=400)
        if "weights" in st.released:  # level 2 discarded them: loading needs wake_up(tags=weights) first
            return JSONResponse({"detail": "weights are asleep"}, status_code=500)
        # tandem_load_weights returns the tensors loaded; vLLM sends results back as strings
        return {"results": ["3"]}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache(request: Request) -> Any:
        return record("/reset_prefix_cache", request, None) or {"success": True}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await request.json()
        if (r := record("/update_weight_version", request, body)) is not None:
            return r
        st.version = body["new_version"]
        return {"success": True, "new_version": st.version}

    @app.get("/weight_info")
    def weight_info(request: Request) -> Any:
        return record("/weight_info", request, None) or {"weight_version": st.version}

    @app.get("/get_world_size")
    def get_world_size(request: Request) -> Any:
        return record("/get_world_size", request, None) or {"world_size": 1}

    @app.post("/init_weight_transfer_engine")
    def init_wte(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/init_weight_transfer_engine", request, body)) is not None:
            return r
        info = body["init_info"]
        join_group(
            info["master_address"], info["master_port"], info["rank_offset"], info["world_size"], VLLM_GROUP
        )
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    def start(request: Request) -> Any:
        if (r := record("/start_weight_update", request, None)) is not None:
            return r
        st.in_update = True
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    def update(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/update_weights", request, body)) is not None:
            return r
        if not st.in_update:
            return JSONResponse(
                {"error": "update_weights called before start_weight_update"}, status_code=500
            )
        info = body["update_info"]
        if set(info) - {"names", "dtype_names", "shapes"}:
            return JSONResponse({"error": f"Invalid update_info {info}"}, status_code=500)
        receive(info["names"], info["dtype_names"], info["shapes"])
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    def finish(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/finish_weight_update", request, body)) is not None:
            return r
        if not st.in_update:
            return JSONResponse({"error": "finish_weight_update without start"}, status_code=500)
        st.in_update = False
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return {"message": "Weight update finished"}

    @app.post("/shutdown_weight_transfer_engine")
    def shutdown(request: Request) -> Any:
        return record("/shutdown_weight_transfer_engine", request, None) or {"message": "shut down"}

    # Sleep mode (vllm/entrypoints/serve/dev/sleep/api_router.py): level and mode are query parameters,
    # wake_up reads repeated `tags` from the query, no tags wakes everything.
    @app.post("/sleep")
    def sleep(request: Request, level: int = 1, mode: str = "abort") -> Any:
        if (r := record("/sleep", request, None)) is not None:
            return r
        if not 0 <= level <= 2 or mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"bad level {level} or mode {mode}"}, status_code=422)
        st.released = {"weights", "kv_cache"} if level >= 1 else set()
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    def wake_up(request: Request) -> Any:
        tags = request.query_params.getlist("tags") or ["weights", "kv_cache"]
        if (r := record("/wake_up", request, {"tags": tags})) is not None:
            return r
        st.released -= set(tags)
        return {"status": "sleeping" if st.released else "awake", "tags": tags}


def _sglang_routes(
    app: FastAPI, st: State, record: Any, tokens_for: Any, join_group: Any, receive: Any
) -> None:
    def fail(message: str) -> JSONResponse:
        return JSONResponse({"success": False, "message": message}, status_code=400)

    # Memory release (sglang/srt/entrypoints/http_server.py): tags in the body, None for all.
    @app.post("/release_memory_occupation")
    async def release(request: Request) -> Any:
        body = await request.json()
        if (r := record("/release_memory_occupation", request, body)) is not None:
            return r
        st.released |= set(body.get("tags") or ["weights", "kv_cache"])
        return {}

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> Any:
        body = await request.json()
        if (r := record("/resume_memory_occupation", request, body)) is not None:
            return r
        st.released -= set(body.get("tags") or ["weights", "kv_cache"])
        return {}

    @app.post("/generate")
    def generate(request: Request, body: dict[str, Any] = Body()) -> Any:
        # A plain def runs in the server's thread pool: a delay injected here holds this request only.
        if (r := record("/generate", request, body)) is not None:
            return r
        if st.released:
            return fail(f"memory released ({sorted(st.released)})")
        out = []
        for prompt, sp in zip(body["input_ids"], body["sampling_params"], strict=True):
            ids = tokens_for(prompt, sp.get("sampling_seed") or 0, sp["max_new_tokens"])
            out.append(
                {
                    "output_ids": ids,
                    "meta_info": {
                        "finish_reason": {"type": "length", "length": len(ids)},
                        "output_token_logprobs": [[-0.5, t, None] for t in ids],
                        "weight_version": st.version,
                        "weight_versions": [{"version": st.version, "start": 0, "end": len(ids)}],
                    },
                }
            )
        return out

    @app.get("/model_info")
    def model_info(request: Request) -> Any:
        return record("/model_info", request, None) or {"weight_version": st.version}

    @app.post("/pause_generation")
    async def pause(request: Request) -> Any:
        body = await request.json()
        if (r := record("/pause_generation", request, body)) is not None:
            return r
        st.paused = body.get("mode", "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def cont(request: Request) -> Any:
        body = await request.json()
        if (r := record("/continue_generation", request, body)) is not None:
            return r
        st.paused = None
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> Any:
        body = await request.json()
        if (r := record("/update_weights_from_disk", request, body)) is not None:
            return r
        if "weights" in st.released:
            return fail("weights are released: resume_memory_occupation(tags=[weights]) first")
        if body.get("weight_version") is not None:
            st.version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await request.json()
        if (r := record("/update_weight_version", request, body)) is not None:
            return r
        st.version = body["new_version"]
        return {"success": True, "new_version": st.version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache(request: Request) -> Any:
        if (r := record("/flush_cache", request, None)) is not None:
            return r
        if st.paused == "in_place":
            return PlainTextResponse("Flush cache failed: requests in the running batch", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/init_weights_update_group")
    def init_group(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/init_weights_update_group", request, body)) is not None:
            return r
        if body["backend"] != "gloo":
            return fail("the replay server joins gloo groups only")
        join_group(
            body["master_address"],
            body["master_port"],
            body["rank_offset"],
            body["world_size"],
            body["group_name"],
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/begin_weight_update")
    def begin(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/begin_weight_update", request, body)) is not None:
            return r
        st.in_update = True
        return {"success": True, "message": ""}

    @app.post("/update_weights_from_distributed")
    def from_dist(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/update_weights_from_distributed", request, body)) is not None:
            return r
        if not st.in_update:
            return fail(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        receive(body["names"], body["dtypes"], body["shapes"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/end_weight_update")
    def end(request: Request, body: dict[str, Any]) -> Any:
        if (r := record("/end_weight_update", request, body)) is not None:
            return r
        st.in_update = False
        return {"success": True, "message": ""}

    @app.post("/destroy_weights_update_group")
    def destroy(request: Request, body: dict[str, Any]) -> Any:
        return record("/destroy_weights_update_group", request, body) or {"success": True, "message": ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["vllm", "sglang"], required=True)
    ap.add_argument("--port-file", required=True)
    args = ap.parse_args()
    port = free_port()
    config = uvicorn.Config(make_app(args.kind), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.rename(args.port_file)
    server.run()


if __name__ == "__main__":
    main()
