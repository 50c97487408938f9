"""A real nginx for the publishing tests and benchmark: its own configuration, pid file, logs and temporary
folders under one folder, on a free loopback port, started as a normal child process (never the system's)."""
import os
import pwd
import re
import shutil
import socket
import subprocess
import time

NGINX = "nginx"
LOGGED = re.compile(r'"(\S+) (\S+) [^"]*" (\d{3}) (\d+)')  # the combined log format: "GET /p HTTP/1.1" 206 1234
CONFIG = """\
daemon off;
worker_processes 1;
{user}pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log {work}/access.log;
    client_body_temp_path {work}/client_body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    types {{ application/json json; text/markdown md; }}
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        # a redirect loop: every path under /loop/ is sent to itself
        location /loop/ {{ return 302 $scheme://$http_host$request_uri; }}
        # the same files at a limited rate per connection: a transfer long enough to be interrupted
        location /slow/ {{ alias {root}/; limit_rate {rate}; }}
    }}
}}
"""


def binary():
    """The nginx program, or None when it is not installed (apt-get install nginx-light)."""
    return shutil.which(NGINX) or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                        if os.access(p, os.X_OK)), None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """nginx serving the folder `root` at http://127.0.0.1:PORT/ until stop(); `work` holds its own files."""

    def __init__(self, root, work, *, slow_rate="20m"):
        self.root, self.work, self.slow_rate = os.path.abspath(root), os.path.abspath(work), slow_rate
        self.proc, self.port = None, None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self, tries=5):
        exe = binary()
        if exe is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        os.makedirs(self.work, exist_ok=True)
        # run as root, nginx hands its workers to the user 'nobody', who cannot read a private folder
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        for _ in range(tries):
            self.port = free_port()
            conf = os.path.join(self.work, "nginx.conf")
            with open(conf, "w") as fh:
                fh.write(CONFIG.format(user=user, work=self.work, port=self.port, root=self.root,
                                         rate=self.slow_rate))
            log = open(os.path.join(self.work, "stderr.log"), "ab")
            self.proc = subprocess.Popen([exe, "-c", conf, "-p", self.work, "-e", os.path.join(self.work, "error.log")],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            log.close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return self
                except OSError:
                    time.sleep(0.05)
            self.stop()  # the port was taken meanwhile, or nginx failed: another port
        raise RuntimeError(f"nginx did not start: see {self.work}/error.log")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: nginx's fast shutdown, its workers with it
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def requests(self):
        """[(method, path, status, body bytes sent)] of every request logged so far (nginx logs a request when it
        ends, also one whose client died)."""
        out = []
        try:
            with open(os.path.join(self.work, "access.log")) as fh:
                for line in fh:
                    m = LOGGED.search(line)
                    if m:
                        out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4))))
        except FileNotFoundError:
            pass
        return out

    def bytes_sent(self, suffix=""):
        """Body bytes nginx sent for the paths ending with `suffix`."""
        return sum(n for _, path, _, n in self.requests() if path.endswith(suffix))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
