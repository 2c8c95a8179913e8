package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
)

// BenchmarkGuestHTTP: net/http between the guests, a client in guest 1
// (this process) and a server process in guest 2, over kernel TCP and
// over guestlib (its Listener for the server, its Dialer in the client's
// Transport), one keep-alive connection, as net/http uses it by default
// (make bench-http; root). get=N fetches N-byte bodies, post=N uploads
// them; the Shunt connection is on the rings before the clock starts.
// Each iteration is 64 MiB of bodies, at least 200 and at most 2000
// requests; the figures are GB/s of bodies and microseconds per request.
func BenchmarkGuestHTTP(b *testing.B) {
	e := newEnv(b, 2, "")
	addrs := map[string]string{}
	for i, st := range []string{"kernel", "shunt"} {
		addrs[st] = httpPeer(b, e, st, 7450+i)
	}
	for _, method := range []string{"get", "post"} {
		for _, size := range []int{1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} {
			for _, st := range []string{"kernel", "shunt"} {
				b.Run(fmt.Sprintf("%s=%s/%s", method, sizeName(size), st), func(b *testing.B) {
					cl, conn := httpClient(b, e, st)
					url := fmt.Sprintf("http://%s/%d", addrs[st], size)
					body := strings.Repeat("x", size)
					do := func() {
						var resp *http.Response
						var err error
						if method == "get" {
							resp, err = cl.Get(url)
						} else {
							resp, err = cl.Post(url, "application/octet-stream", strings.NewReader(body))
						}
						if err != nil {
							b.Fatal(err)
						}
						n, err := io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if err != nil || resp.StatusCode != 200 || method == "get" && n != int64(size) {
							b.Fatalf("%s %s: %s, %d bytes, %v", method, url, resp.Status, n, err)
						}
					}
					do()
					if st == "shunt" && !fastSoon(b, *conn) {
						b.Fatalf("the HTTP connection stayed on %s", (*conn).Path())
					}
					reqs := min(max(200, (64<<20)/size), 2000)
					var gbs, usReq []float64
					for b.Loop() {
						start := time.Now()
						for range reqs {
							do()
						}
						d := time.Since(start)
						gbs = append(gbs, float64(reqs*size)/d.Seconds()/1e9)
						usReq = append(usReq, float64(d.Microseconds())/float64(reqs))
					}
					b.ReportMetric(median(gbs), "GB/s")
					b.ReportMetric(median(usReq), "us/req")
				})
			}
		}
	}
}

// httpClient is an http.Client in guest 1 for stack st: one keep-alive
// connection, dialed with guestlib for shunt (*conn is it, once dialed).
func httpClient(b *testing.B, e *env, st string) (*http.Client, **guestlib.Conn) {
	conn := new(*guestlib.Conn)
	dial := func(ctx context.Context, _, addr string) (net.Conn, error) {
		if st == "shunt" {
			c, err := e.Dial(ctx, 1, addr)
			*conn = c
			return c, err
		}
		var c net.Conn
		err := nsrig.In(e.rig.Guests[0].NSPath(), func() (err error) { c, err = net.Dial("tcp4", addr); return err })
		return c, err
	}
	tr := &http.Transport{DialContext: dial, MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1, DisableCompression: true}
	b.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}, conn
}

// httpPeer starts the HTTP server process of stack st in guest 2.
func httpPeer(b testing.TB, e *env, st string, port int) string {
	g2 := e.rig.Guests[1]
	addr := netip.AddrPortFrom(g2.Addr, uint16(port)).String()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SHUNT_E2E_CHILD=http", "SHUNT_E2E_STACK="+st,
		"SHUNT_E2E_ADDR="+addr, "SHUNT_CONTROL="+e.control(g2))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := nsrig.Start(g2.NSPath(), cmd); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	buf := make([]byte, 6)
	if _, err := io.ReadFull(out, buf); err != nil || string(buf) != "ready\n" {
		b.Fatalf("http peer: %q, %v", buf, err)
	}
	return addr
}

// httpChild is the "http" child: GET /N answers N bytes, POST answers
// the length of the body it read (io.Copy into io.Discard).
func httpChild(addr, st string) int {
	l, err := perf.Listen(st, addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		return 1
	}
	page := []byte(strings.Repeat("x", 16<<20))
	fmt.Println("ready")
	err = http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			n, err := io.Copy(io.Discard, r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			fmt.Fprint(w, n)
			return
		}
		n, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/"))
		if err != nil || n < 0 || n > len(page) {
			http.Error(w, "want /N, N up to 16 MiB", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(n))
		w.Write(page[:n])
	}))
	fmt.Fprintln(os.Stderr, "serve:", err)
	return 1
}
