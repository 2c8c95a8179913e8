package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
)

// TestConnConformance runs x/net/nettest's net.Conn conformance suite on
// guestlib connections, on the fast path and on TCP (a policy rule). Each
// connection starts on TCP; the fast ones are on the rings before the
// suite uses them.
func TestConnConformance(t *testing.T) {
	e := newEnv(t, 2, `rule "fallback" {
  action = "tcp"
  ports  = ["5301"]
}`)
	for _, tc := range []struct {
		name string
		port int
		fast bool
	}{{"fastpath", 5300, true}, {"fallback", 5301, false}} {
		t.Run(tc.name, func(t *testing.T) {
			l := e.listen(2, tc.port)
			nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
				acc := make(chan *guestlib.Conn, 1)
				go func() {
					s, err := l.AcceptShunt()
					if err != nil {
						t.Errorf("accept: %v", err)
					}
					acc <- s
				}()
				c, err := e.dial(1, fmt.Sprintf("%s:%d", e.rig.Guests[1].Addr, tc.port))
				if err != nil {
					return nil, nil, nil, err
				}
				s := <-acc
				settle(t, c, tc.fast, 5*time.Second)
				settle(t, s, tc.fast, 5*time.Second)
				return c, s, func() { c.Close(); s.Close() }, nil
			})
		})
	}
}

// TestHTTPOverGuestlib: net/http's server and client run over guestlib
// connections, which move to the fast path while they serve.
func TestHTTPOverGuestlib(t *testing.T) {
	e := newEnv(t, 2, "")
	l := e.listen(2, 8081)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "hello %s, you sent %d bytes", r.URL.Path[1:], len(body))
	})}
	go srv.Serve(l)
	defer srv.Close()
	var mu sync.Mutex
	var dialed []*guestlib.Conn
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c *guestlib.Conn
			err := nsrig.In(e.rig.Guests[0].NSPath(), func() error {
				var err error
				d := guestlib.Dialer{Client: e.Clients[0]}
				c, err = d.DialContext(ctx, "tcp4", addr)
				return err
			})
			if err == nil {
				mu.Lock()
				dialed = append(dialed, c)
				mu.Unlock()
			}
			return c, err
		},
	}}
	defer client.CloseIdleConnections()
	for i := range 3 {
		resp, err := client.Post(fmt.Sprintf("http://%s:8081/shunt", e.rig.Guests[1].Addr), "text/plain", strings.NewReader(strings.Repeat("x", 100000*i)))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := fmt.Sprintf("hello shunt, you sent %d bytes", 100000*i); string(b) != want {
			t.Fatalf("response %q, want %q", b, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	ringBytes := func() (n uint64) {
		for _, c := range dialed {
			n += c.Stats().RingSent
		}
		return n
	}
	mu.Unlock()
	// The connection moves to the rings once hostd's READY reached both
	// ends: requests from then on take them.
	eventually(t, 5*time.Second, "requests on the rings", func() bool {
		resp, err := client.Post(fmt.Sprintf("http://%s:8081/again", e.rig.Guests[1].Addr), "text/plain", strings.NewReader("more"))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		mu.Lock()
		defer mu.Unlock()
		return ringBytes() > 0
	})
	mu.Lock()
	if fl := e.flows(); len(fl) < 1 {
		t.Fatalf("hostd lists no flow for the HTTP connection")
	}
}

// TestZeroCopyAPI: ReadBuffer/ReleaseRead and WriteBuffer/CommitWrite move
// the same bytes as Read and Write, on the fast path and on the fallback.
func TestZeroCopyAPI(t *testing.T) {
	e := newEnv(t, 2, `rule "fallback" {
  action = "tcp"
  ports  = ["5311"]
}`)
	for _, tc := range []struct {
		port int
		fast bool
	}{{5310, true}, {5311, false}} {
		c, s := e.pair(1, 2, tc.port)
		settle(t, c, tc.fast, 5*time.Second)
		settle(t, s, tc.fast, 5*time.Second)
		want := []byte(strings.Repeat("zero-copy ", 10000))
		go func() {
			for off := 0; off < len(want); {
				b, err := c.WriteBuffer(len(want) - off)
				if err != nil {
					t.Errorf("WriteBuffer: %v", err)
					return
				}
				n := copy(b, want[off:])
				if err := c.CommitWrite(n); err != nil {
					t.Errorf("CommitWrite: %v", err)
					return
				}
				off += n
			}
			c.CloseWrite()
		}()
		var got []byte
		for {
			b, err := s.ReadBuffer(4096)
			got = append(got, b...)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("ReadBuffer: %v", err)
			}
			if err := s.ReleaseRead(len(b)); err != nil {
				t.Fatal(err)
			}
		}
		if string(got) != string(want) {
			t.Fatalf("port %d: received %d bytes, want %d equal bytes", tc.port, len(got), len(want))
		}
		if st := c.Stats(); tc.fast && st.RingSent != uint64(len(want)) || !tc.fast && st.TCPSent != uint64(len(want)) {
			t.Fatalf("port %d: %+v, want every byte on the path of fast=%v", tc.port, st, tc.fast)
		}
	}
}
