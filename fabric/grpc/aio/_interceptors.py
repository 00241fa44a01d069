"""Client interceptors of aio channels, as grpc.aio chains them: the call
a chain of interceptors produced (or what an interceptor returned in its
place) behind the grpc.aio call interfaces."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc.aio import EOF, AioRpcError, Metadata


class _WriteQueue:
    """The request iterator behind write()/done_writing() of an intercepted call."""

    def __init__(self):
        self.queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is EOF:
            raise StopAsyncIteration
        return item


class _InterceptedCall:
    """A call whose invocation went through client interceptors: it
    delegates to the call the chain produced (or serves what an interceptor
    returned in its place: a response, or an async iterator of responses)."""

    def __init__(self, interceptors, kind, request, details, invoke):
        self._loop = asyncio.get_running_loop()
        self._inner = None                 # the grpc.aio call, once the chain made it
        self._inner_ready = self._loop.create_future()
        self._result = None                # what the chain returned
        self._writes = None
        self._deadline = None if details.timeout is None else self._loop.time() + details.timeout
        if kind.startswith("stream") and request is None:
            self._writes = request = _WriteQueue()
        self._task = self._loop.create_task(self._run(interceptors, kind, request, details, invoke))

    async def _run(self, interceptors, kind, request, details, invoke):
        method = f"intercept_{kind}"

        async def at(index, d, req):
            if index == len(interceptors):
                call = invoke(d, req)
                if self._inner is None:
                    self._set_inner(call)
                return call

            async def continuation(next_details, next_request):
                return await at(index + 1, next_details, next_request)
            return await getattr(interceptors[index], method)(continuation, d, req)
        try:
            self._result = await at(0, details, request)
        finally:
            if not self._inner_ready.done():
                self._inner_ready.set_result(None)
        if isinstance(self._result, grpc.aio.Call) and self._result is not self._inner:
            self._inner = self._result
        return self._result

    def _set_inner(self, call):
        self._inner = call
        if not self._inner_ready.done():
            self._inner_ready.set_result(None)

    async def _call(self):
        await self._task
        return self._inner

    def cancel(self) -> bool:
        if self._inner is not None:
            return self._inner.cancel()
        return self._task.cancel()

    def cancelled(self) -> bool:
        return self._inner.cancelled() if self._inner is not None else self._task.cancelled()

    def done(self) -> bool:
        return self._inner.done() if self._inner is not None else self._task.done()

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def add_done_callback(self, callback):
        if self._inner is not None:
            self._inner.add_done_callback(lambda _call: callback(self))
        else:
            self._task.add_done_callback(lambda _t: self.add_done_callback(callback))

    async def initial_metadata(self):
        inner = await self._call()
        return await inner.initial_metadata() if inner is not None else Metadata()

    async def trailing_metadata(self):
        inner = await self._call()
        return await inner.trailing_metadata() if inner is not None else Metadata()

    async def code(self):
        try:
            inner = await self._call()
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED
        except AioRpcError as e:
            return e.code()
        return await inner.code() if inner is not None else grpc.StatusCode.OK

    async def details(self):
        try:
            inner = await self._call()
        except AioRpcError as e:
            return e.details()
        return await inner.details() if inner is not None else ""

    async def wait_for_connection(self):
        await self._inner_ready
        if self._inner is not None:
            await self._inner.wait_for_connection()

    # -- unary responses
    async def _response(self):
        result = await self._task
        if isinstance(result, grpc.aio.Call):
            return await result
        return result

    def __await__(self):
        return self._response().__await__()

    # -- streaming responses
    async def read(self):
        result = await self._task
        if isinstance(result, grpc.aio.Call):
            return await result.read()
        if not hasattr(self, "_source"):
            self._source = result.__aiter__()
        try:
            return await self._source.__anext__()
        except StopAsyncIteration:
            return EOF

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            msg = await self.read()
            if msg is EOF:
                return
            yield msg

    # -- streaming requests
    async def write(self, request):
        if self._writes is None:
            raise grpc.aio.UsageError("write() is not allowed with a request iterator")
        await self._writes.queue.put(request)

    async def done_writing(self):
        if self._writes is None:
            raise grpc.aio.UsageError("done_writing() is not allowed with a request iterator")
        await self._writes.queue.put(EOF)


class InterceptedUnaryUnaryCall(_InterceptedCall, grpc.aio.UnaryUnaryCall):
    pass


class InterceptedUnaryStreamCall(_InterceptedCall, grpc.aio.UnaryStreamCall):
    pass


class InterceptedStreamUnaryCall(_InterceptedCall, grpc.aio.StreamUnaryCall):
    pass


class InterceptedStreamStreamCall(_InterceptedCall, grpc.aio.StreamStreamCall):
    pass


INTERCEPTOR_KINDS = {"unary_unary": (grpc.aio.UnaryUnaryClientInterceptor, InterceptedUnaryUnaryCall),
                      "unary_stream": (grpc.aio.UnaryStreamClientInterceptor, InterceptedUnaryStreamCall),
                      "stream_unary": (grpc.aio.StreamUnaryClientInterceptor, InterceptedStreamUnaryCall),
                      "stream_stream": (grpc.aio.StreamStreamClientInterceptor, InterceptedStreamStreamCall)}
