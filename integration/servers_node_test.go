package integration

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A Node.js keep-alive server that closes idle connections (issue 21):
// libuv closes them with syscall(SYS_close).

// nodeServer is an HTTP server that keeps connections alive for 300 ms of
// idleness only (then Node closes them, with libuv's raw close), and
// answers /N with N bytes of a pattern the client checks.
const nodeServer = `
const http = require('http');
const [host, port] = [process.argv[2], +process.argv[3]];
const srv = http.createServer((req, res) => {
  const n = parseInt(req.url.slice(1)) || 1;
  const b = Buffer.alloc(n);
  for (let i = 0; i < n; i++) b[i] = (i * 7 + n) & 255;
  res.end(b);
});
srv.keepAliveTimeout = 300;
srv.listen(port, host, () => console.log('LISTENING'));
`

// nodeClient makes rounds of requests on keep-alive connections, each
// with a 5 s deadline, checks every body, and waits 600 ms between rounds
// so that the server closes the idle connections and the next round
// opens new ones (which may reuse the closed ones' fd numbers).
const nodeClient = `
const http = require('http');
const [host, port, rounds, per] = [process.argv[2], +process.argv[3], +process.argv[4], +process.argv[5]];
const agent = new http.Agent({ keepAlive: true, maxSockets: 4 });
function get(n) {
  return new Promise((resolve, reject) => {
    const req = http.get({ host, port, path: '/' + n, agent }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const b = Buffer.concat(chunks);
        if (b.length !== n) return reject(new Error('/' + n + ': ' + b.length + ' bytes'));
        for (let i = 0; i < n; i++) if (b[i] !== ((i * 7 + n) & 255)) return reject(new Error('/' + n + ': wrong byte ' + i));
        resolve();
      });
    });
    req.setTimeout(5000, () => { req.destroy(new Error('/' + n + ': no response in 5 s')); });
    req.on('error', reject);
  });
}
(async () => {
  let done = 0;
  for (let r = 0; r < rounds; r++) {
    const ps = [];
    for (let k = 0; k < per; k++) ps.push(get(1 + ((r * per + k) * 7919) % 300000));
    await Promise.all(ps);
    done += per;
    await new Promise((ok) => setTimeout(ok, 600));
  }
  console.log('OK', done);
})().catch((e) => { console.log('FAIL', e.message); process.exit(1); });
`

// TestServerNode: a Node.js keep-alive server that closes connections
// idle for 300 ms, and a Node.js client that makes 5 rounds of 16
// requests (4 connections at a time), waiting 600 ms between rounds: the
// server closes each idle connection, and every request of the next round,
// on new connections, must be answered within 5 s, with the right body.
// The connections take the rings.
func TestServerNode(t *testing.T) {
	s := newSrvEnv(t, "node")
	dir := servedDir(t)
	for name, src := range map[string]string{"server.js": nodeServer, "client.js": nodeClient} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	g2 := s.rig.Guests[1].Addr.String()
	srv := s.start(2, s.command(2, true, nil, "node", filepath.Join(dir, "server.js"), g2, "8200"))
	s.waitListening(2, 8200)
	out := s.run(1, 60*time.Second, s.command(1, true, []string{"SHUNT_STATS=1"}, "node", filepath.Join(dir, "client.js"), g2, "8200", "5", "16"))
	if !strings.Contains(out, "OK 80") {
		s.fatalf("node client: want OK 80 (5 rounds of 16 requests, each body checked):\n%s", tailLines(out, 40))
	}
	if fastLines(out) < 4 {
		s.fatalf("the node client's connections did not take the rings: %s", pathSummary(out))
	}
	sout := srv.out.String()
	if srv.exited() {
		s.fatalf("the node server exited: %v", srv.err)
	}
	t.Logf("node keep-alive (idle connections closed by the server): client: %s; server: %s", pathSummary(out), pathSummary(sout))
}
