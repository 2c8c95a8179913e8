"""A server that hands each connection to a subprocess (issue 21):
subprocess.Popen(['cat'], stdin=conn, stdout=conn), which CPython runs
with vfork() where it can. The parent keeps its own copy for 1 s (keep)
or closes it at once (close), then prints a line on its own stdout: a
parent whose stdout the library took for a connection fails there
(ENOTSOCK) and dies.

    python3 subproc_server.py IP PORT keep|close
"""
import socket
import subprocess
import sys
import time

ip, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((ip, port))
ls.listen(16)
print("listening", flush=True)
n = 0
while True:
    conn, _ = ls.accept()
    p = subprocess.Popen(["cat"], stdin=conn, stdout=conn)
    if mode == "keep":
        time.sleep(1)
    conn.close()
    rc = p.wait()
    n += 1
    print("PASS served %d (%s, cat exit %d)" % (n, mode, rc), flush=True)
