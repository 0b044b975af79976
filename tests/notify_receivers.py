"""Real receivers for the run's messages, on loopback: an SMTP server (aiosmtpd) and an HTTP webhook that Apprise's
JSON target posts to. `Receivers.params()` are the notify Params that point a run at both; the SMTP server is an
Airflow connection given by environment variable (AIRFLOW_CONN_<ID>), as a deployment may."""

from __future__ import annotations

import email
import html
import json
import socket
import threading
from email.policy import default as default_policy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SMTP_CONN_ID = "dflash_test_smtp"
TO = "ops@example.test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Mailbox:
    def __init__(self):
        self.messages: list[email.message.EmailMessage] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's handler hook
        self.messages.append(email.message_from_bytes(envelope.content, policy=default_policy))
        return "250 OK"


class Receivers:
    """Both receivers, started and stopped with `with`; `emails()` and `posts()` are the message texts they got."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.mailbox = _Mailbox()
        self.smtp = Controller(self.mailbox, hostname="127.0.0.1", port=free_port())
        self.hooks: list[dict] = []
        hooks = self.hooks

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's handler hook
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hooks.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Hook)

    def __enter__(self) -> Receivers:
        self.smtp.start()
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.smtp.stop()
        self.http.shutdown()
        self.http.server_close()

    def connection_env(self) -> dict[str, str]:
        """The SMTP connection as Airflow reads it from the environment (plain SMTP on loopback: no TLS)."""
        conn = {"conn_type": "smtp", "host": "127.0.0.1", "port": self.smtp.port,
                "extra": {"from_email": "airflow@example.test", "disable_ssl": True, "disable_tls": True,
                          "retry_limit": 0, "timeout": 10}}
        return {f"AIRFLOW_CONN_{SMTP_CONN_ID.upper()}": json.dumps(conn)}

    def params(self) -> dict:
        return {"notify_email_to": TO, "notify_smtp_conn_id": SMTP_CONN_ID,
                "notify_apprise_urls": [f"json://127.0.0.1:{self.http.server_port}/dflash"]}

    def emails(self) -> list[str]:
        """Each email's text: its subject, then its body (the HTML's text)."""
        out = []
        for msg in self.mailbox.messages:
            assert msg["To"] == TO, msg["To"]
            part = msg.get_body(("html", "plain"))
            body = html.unescape(part.get_content().replace("\r\n", "\n")).removeprefix("<pre>").removesuffix("</pre>")
            out.append(f"Subject: {msg['Subject']}\n{body}")
        return out

    def posts(self) -> list[str]:
        """Each webhook post's message (Apprise's JSON target: version, title, message, type)."""
        return [p["message"] for p in self.hooks]
