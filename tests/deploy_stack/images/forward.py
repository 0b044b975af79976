"""Node 1's address on the private network, for the rehearsal's second GPU node (tests/deploy_stack/): one host name
that forwards Postgres, Redis and the api-server's ports to their containers, as node 1 publishes them there.

    python3 forward.py 5432=postgres:5432 6379=redis:6379 8080=airflow-apiserver:8080
"""

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def handler(host: str, port: int):
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))
    return handle


async def main(specs: list[str]) -> None:
    servers = []
    for spec in specs:
        listen, target = spec.split("=")
        host, port = target.rsplit(":", 1)
        servers.append(await asyncio.start_server(handler(host, int(port)), "0.0.0.0", int(listen)))
    print("forwarding", " ".join(specs), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
