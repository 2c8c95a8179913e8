package peers

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"time"
)

// Config is hostd.hcl's peering block and its peer blocks.
type Config struct {
	Listen      string // host:port the channel listens on; "" = dial only
	Certificate string // this hostd's certificate (PEM); its first DNS name is this hostd's name
	Key         string // its key (PEM)
	CA          string // the CA (PEM) that signs every peer's certificate
	// Interval is how often a quiet channel is pinged; one silent for 3
	// intervals is down. 0 = 1s.
	Interval time.Duration
	// Relay is host:port the relay link listens on (peers that this host
	// does not dial make their links to it); "" = Listen's host, any port;
	// without Listen, this host accepts no link (it dials every peer).
	Relay string
	Peers []Peer
}

// RelayListen is the address the relay link listens on, "" for none.
func (c *Config) RelayListen() string {
	if c.Relay != "" || c.Listen == "" {
		return c.Relay
	}
	host, _, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return ""
	}
	return net.JoinHostPort(host, "0")
}

// Peer is one remote hostd.
type Peer struct {
	Name     string         // the DNS name on its certificate
	Address  string         // host:port of its channel
	Prefixes []netip.Prefix // the guest addresses it may announce
}

// Check reports what is wrong in c, all at once.
func (c *Config) Check() error {
	var errs []error
	if c.Certificate == "" || c.Key == "" || c.CA == "" {
		errs = append(errs, errors.New("peering: certificate, key and ca are all required"))
	}
	seen := map[string]bool{}
	for _, p := range c.Peers {
		if p.Name == "" || seen[p.Name] {
			errs = append(errs, fmt.Errorf("peer %q: want a unique, non-empty name", p.Name))
		}
		seen[p.Name] = true
		if p.Address == "" {
			errs = append(errs, fmt.Errorf("peer %q: an address is required", p.Name))
		}
		if len(p.Prefixes) == 0 {
			errs = append(errs, fmt.Errorf("peer %q: no prefixes: it could announce nothing", p.Name))
		}
		for _, q := range p.Prefixes {
			if !q.IsValid() || q != q.Masked() {
				errs = append(errs, fmt.Errorf("peer %q: prefix %s: want a masked prefix (%s)", p.Name, q, q.Masked()))
			}
		}
	}
	return errors.Join(errs...)
}

// peer returns the configured peer named name.
func (c *Config) peer(name string) (Peer, bool) {
	i := slices.IndexFunc(c.Peers, func(p Peer) bool { return p.Name == name })
	if i < 0 {
		return Peer{}, false
	}
	return c.Peers[i], true
}

// creds is the TLS material of one configuration: this hostd's
// certificate and name, and the CA pool peers are checked against.
type creds struct {
	cert tls.Certificate
	name string
	pool *x509.CertPool
}

func loadCreds(c *Config) (*creds, error) {
	cert, err := tls.LoadX509KeyPair(c.Certificate, c.Key)
	if err != nil {
		return nil, fmt.Errorf("peering: certificate and key: %w", err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("peering: certificate: %w", err)
	}
	if len(leaf.DNSNames) == 0 {
		return nil, errors.New("peering: the certificate names no DNS name: a hostd is known by the first one")
	}
	pem, err := os.ReadFile(c.CA)
	if err != nil {
		return nil, fmt.Errorf("peering: ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("peering: ca %s: no certificate in it", c.CA)
	}
	return &creds{cert: cert, name: leaf.DNSNames[0], pool: pool}, nil
}

// client is the TLS configuration to dial peer name: its certificate must
// chain to the CA and carry that name.
func (cr *creds) client(name string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cr.cert},
		RootCAs: cr.pool, ServerName: name,
	}
}

// server is the TLS configuration to accept peers: a client certificate
// that chains to the CA is required (its name is checked after the
// handshake, against the peer blocks).
func (cr *creds) server() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cr.cert},
		ClientCAs: cr.pool, ClientAuth: tls.RequireAndVerifyClientCert,
	}
}

// TLSInfo is what `hostd check` reports of the peering TLS material.
type TLSInfo struct {
	Name     string    // this hostd's name among its peers
	NotAfter time.Time // its certificate's expiry
}

// Inspect loads c's TLS material and checks that this hostd's own
// certificate chains to the CA and names it for both TLS roles, as every
// peer will check it.
func Inspect(c *Config) (TLSInfo, error) {
	cr, err := loadCreds(c)
	if err != nil {
		return TLSInfo{}, err
	}
	leaf, err := x509.ParseCertificate(cr.cert.Certificate[0])
	if err != nil {
		return TLSInfo{}, err
	}
	inter := x509.NewCertPool()
	for _, der := range cr.cert.Certificate[1:] {
		if ic, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(ic)
		}
	}
	info := TLSInfo{Name: cr.name, NotAfter: leaf.NotAfter}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: cr.pool, Intermediates: inter, DNSName: cr.name,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}})
	if err != nil {
		return info, fmt.Errorf("peering: this hostd's certificate does not verify against the CA, as its peers will check it: %w", err)
	}
	return info, nil
}
