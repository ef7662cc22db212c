DROP TABLE external_calls;
DROP TABLE consumer_quarantine;
DROP TABLE consumer_sequences;
