package virt

import (
	"context"
	"errors"
	"sort"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
)

// Registry is what the watcher drives: hostd's set of guests.
type Registry interface {
	// Register adds a running domain as a guest; an error leaves it out
	// (the watcher logs it and tries again when the domain changes).
	Register(d Domain) error
	// Unregister removes a guest Register added: the domain stopped.
	Unregister(d Domain)
}

// Source is one connection to libvirtd. Dial (libvirt.go) gives the real
// one over go-libvirt; unit tests use a fake.
type Source interface {
	// Active returns the live XML of every active domain, by name.
	Active() (map[string][]byte, error)
	// Events delivers a value after each domain lifecycle event; it is
	// closed when the connection ends.
	Events() <-chan struct{}
	Close() error
}

// Options tune a Watcher; the zero value is usable.
type Options struct {
	Retry time.Duration // first reconnect delay, doubled up to 10x; default 500ms
	Tick  time.Duration // reconcile at least this often; default 30s
}

// Status is the watcher's state for `hostd status` and metrics.
type Status struct {
	Connected bool     `json:"connected"`
	Domains   []string `json:"domains"`
	Syncs     uint64   `json:"syncs"`
	LastError string   `json:"last_error,omitempty"`
}

// Watcher keeps a Registry in step with libvirtd's running domains. Start
// it once; Close stops it and waits. Status is safe for concurrent use.
type Watcher struct {
	log  hclog.Logger
	dial func(context.Context) (Source, error)
	reg  Registry
	opts Options

	cancel context.CancelFunc
	done   chan struct{}

	mu        sync.Mutex
	known     map[string]Domain // registered, by name
	complaint map[string]string // last error logged per domain, to log once
	connected bool
	syncs     uint64
	lastErr   string
}

// NewWatcher returns a watcher that reaches libvirtd with dial.
func NewWatcher(log hclog.Logger, dial func(context.Context) (Source, error), reg Registry, opts Options) *Watcher {
	if opts.Retry <= 0 {
		opts.Retry = 500 * time.Millisecond
	}
	if opts.Tick <= 0 {
		opts.Tick = 30 * time.Second
	}
	return &Watcher{log: log, dial: dial, reg: reg, opts: opts, known: map[string]Domain{}, complaint: map[string]string{}}
}

// Start connects and reconciles once before it returns (so hostd knows its
// VMs before it adopts their flows), then follows libvirtd in the
// background, reconnecting whenever the connection ends. An error means
// the first attempt failed; the watcher keeps trying anyway.
func (w *Watcher) Start(ctx context.Context, first time.Duration) error {
	ctx, w.cancel = context.WithCancel(ctx)
	w.done = make(chan struct{})
	fctx, cancel := context.WithTimeout(ctx, first)
	src, err := w.connect(fctx)
	cancel()
	go w.run(ctx, src)
	return err
}

// Close stops following libvirtd and waits. Registered guests stay
// registered: hostd stopping is not the domains stopping.
func (w *Watcher) Close() {
	if w.cancel != nil {
		w.cancel()
		<-w.done
	}
}

// Status returns the watcher's state.
func (w *Watcher) Status() Status {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := Status{Connected: w.connected, Syncs: w.syncs, LastError: w.lastErr}
	for n := range w.known {
		st.Domains = append(st.Domains, n)
	}
	sort.Strings(st.Domains)
	return st
}

func (w *Watcher) connect(ctx context.Context) (Source, error) {
	src, err := w.dial(ctx)
	if err != nil {
		w.setErr(err)
		return nil, err
	}
	w.mu.Lock()
	w.connected = true
	w.mu.Unlock()
	w.log.Info("connected to libvirtd")
	if err := w.reconcile(src); err != nil {
		src.Close()
		w.disconnected()
		return nil, err
	}
	return src, nil
}

func (w *Watcher) run(ctx context.Context, src Source) {
	defer close(w.done)
	retry := w.opts.Retry
	for {
		if src == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry):
			}
			var err error
			if src, err = w.connect(ctx); err != nil {
				retry = min(2*retry, 10*w.opts.Retry)
				continue
			}
		}
		retry = w.opts.Retry
		w.follow(ctx, src)
		src.Close()
		w.disconnected()
		if ctx.Err() != nil {
			return
		}
		w.log.Warn("lost libvirtd; keeping the registered domains and reconnecting")
		src = nil
	}
}

// follow reconciles on every event and tick until the connection ends.
func (w *Watcher) follow(ctx context.Context, src Source) {
	tick := time.NewTicker(w.opts.Tick)
	defer tick.Stop()
	events := src.Events()
	for {
		select {
		case <-ctx.Done():
			return
		case _, ok := <-events:
			if !ok {
				return
			}
			// Events come in bursts (defined, started, resumed): one
			// reconcile covers those already queued.
			for drained := false; !drained; {
				select {
				case _, ok = <-events:
					if !ok {
						return
					}
				default:
					drained = true
				}
			}
		case <-tick.C:
		}
		if err := w.reconcile(src); err != nil {
			return
		}
	}
}

// reconcile registers the running Shunt domains not yet registered (or
// changed), and unregisters those no longer running.
func (w *Watcher) reconcile(src Source) error {
	xmls, err := src.Active()
	if err != nil {
		w.setErr(err)
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.syncs++
	names := make([]string, 0, len(xmls))
	for n := range xmls {
		names = append(names, n)
	}
	sort.Strings(names)
	running := map[string]Domain{}
	for _, name := range names {
		d, err := ParseDomain(xmls[name])
		if errors.Is(err, ErrNotShunt) {
			continue
		}
		if err != nil {
			w.complainLocked(name, err)
			continue
		}
		running[name] = d
	}
	// Release first (stopped or changed domains), so what they held (an
	// id, a socket path) is free for the domains registered next.
	for name, old := range w.known {
		if d, ok := running[name]; ok && d.Equal(old) {
			continue
		} else if ok {
			w.log.Info("domain changed; registering it again", "domain", name)
		} else {
			w.log.Info("domain released", "domain", name)
		}
		w.reg.Unregister(old)
		delete(w.known, name)
	}
	for _, name := range names {
		d, ok := running[name]
		if _, known := w.known[name]; !ok || known {
			continue
		}
		if err := w.reg.Register(d); err != nil {
			w.complainLocked(name, err)
			continue
		}
		delete(w.complaint, name)
		w.known[name] = d
		w.log.Info("domain registered", "domain", name, "id", d.ID, "control", d.Controls, "tap", d.Tap)
	}
	for name := range w.complaint {
		if _, ok := xmls[name]; !ok {
			delete(w.complaint, name)
		}
	}
	return nil
}

func (w *Watcher) complainLocked(name string, err error) {
	if w.complaint[name] != err.Error() {
		w.complaint[name] = err.Error()
		w.log.Error("domain not registered", "domain", name, "error", err)
	}
}

func (w *Watcher) setErr(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.lastErr != err.Error() {
		w.log.Warn("libvirtd unreachable; retrying", "error", err)
	}
	w.lastErr = err.Error()
}

func (w *Watcher) disconnected() {
	w.mu.Lock()
	w.connected = false
	w.mu.Unlock()
}
